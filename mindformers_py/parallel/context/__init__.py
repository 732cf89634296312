"""Context parallelism: every sequence split over ``context_parallel`` ranks (Ulysses, ring or hybrid attention).

:mod:`.apply` applies it to a model from outside (attention cores, mask hooks, the batch's chunks);
:mod:`.attention` holds the three attention algorithms, :mod:`.layout` which tokens each rank holds, :mod:`.data`
the batch's side (each rank's chunks, labels shifted first), and :mod:`.checks` what it can and cannot do, checked
before any process group or weight exists.
"""
