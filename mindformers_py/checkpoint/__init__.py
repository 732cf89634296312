"""Checkpoint files: their formats and the code that reads and writes them.

Weights as safetensors folders (:mod:`.safetensors_io`: single or sharded with an index, written under a temporary
name and renamed when complete; :mod:`.streamed_safetensors`: written tensor by tensor into size-bounded shards;
:mod:`.reader`: read lazily, a tensor or a slice at a time), a checkpoint's manifest (:mod:`.manifest`), free space
for a save (:mod:`.disk_space`), sharded training state with ``torch.distributed.checkpoint`` and its consolidation
(:mod:`.sharded`); a stand-alone run's other state files (optimizer, scheduler, fp16 scaler: :mod:`.state_files`) and
random-number states (:mod:`.rng_state`); the background thread that writes a checkpoint while training goes on
(:mod:`.background_writer`).

The wing sits directly above :mod:`mindformers_py.parallel`: the sharded side reads the model families' table and tied
weights (:mod:`mindformers_py.models`) to consolidate and asks whether a model is wrapped by peft
(:mod:`mindformers_py.parallel.tensor.adapters`); nothing in ``parallel/`` or below reads or writes a checkpoint file.
It sits below everything that loads or saves models: ``loading/``, the Auto classes, adapters, conversion, the engines
and the Trainer. Policy stays with its owner: which checkpoints a run keeps and which it resumes from are the
Trainer's (:mod:`mindformers_py.trainer.checkpoint`), converting a folder between transformers' names and ours is
:mod:`mindformers_py.convert`'s, a peft adapter's files are :mod:`mindformers_py.adapters`'.
"""
