"""What the tests share and are not tests themselves: tiny reference models per family (``hf_models``,
``bert_models``, ``t5_models``, ``vit_models``), the task models and data of the gradient-equivalence tests
(``task_models``), tolerances, and the multi-process helpers (``dist_utils``: spawning gloo workers;
``launch_workers`` and ``fault_workers``: the scripts the launcher tests run under torchrun). Tests import them as
``from support.<module> import ...`` (pytest puts ``tests/`` on the path through its root ``conftest.py``)."""
