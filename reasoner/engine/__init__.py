"""What every training stage shares: LoRA in place (`lora`), the fused vocabulary head
(`heads`), batched sampling (`sampler`) and rollouts scored by the rewards (`rollout`), the
train state and step machinery (`trainer`), checkpoints (`checkpoint`), the run's manifest
(`manifest`), metrics (`metrics`) and the session's clock (`session`)."""
