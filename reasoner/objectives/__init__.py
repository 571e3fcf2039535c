"""Training stages: each a loss, the batches it trains on and its train step, plugged into the
one loop (`reasoner.loop`) as a `Stage`: `grpo` (rollouts scored by rewards), `sft` (written
responses), `preference` (DPO, IPO, SimPO, ORPO on pairs, `pairs`: the policy's own) and
`distill` (on-policy distillation from a teacher). A new stage is a module here."""
