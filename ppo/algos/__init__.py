"""Pure algorithm functions over tensors: advantages, losses, KL, rollout correction, DAPO's sampling rules."""
