"""Planning a run for a TPU slice from any CPU machine: the chips' figures and the ring model of
a collective (`chips`), what `rollout.layout: auto` and `mesh.weights: auto` pick (`layout`),
FLOPs, bytes and collectives read from compiled HLO (`hlo`), the run's own steps compiled ahead
of time (`plan`) and the report `python -m reasoner plan` prints (`report`)."""
