"""Training stages: each a loss, the batches it trains on and its train step, plugged into the
one loop (`reasoner.loop`) as a `Stage`: `grpo` (rollouts scored by rewards), `sft` (written
responses). A new stage (preference optimisation, distillation) is a module here."""
