"""The PPO/GRPO step loop over the role groups of a device plan (driven by launcher/main.py).

    torchrun --nproc_per_node 2 launcher/main.py conf/ppo_tiny.yaml

One step, on every rank (each rank does the stages of the roles it hosts; in split
placement the groups work concurrently and meet at two exchanges):

    prompts -> generate (actor ranks, hybrid engine) -> share samples
            -> old log-probs (actor) | ref log-probs (ref) | values (critic) | scores (reward)
            -> merge results -> advantages (pure, every rank) -> actor update | critic update
            -> metrics.jsonl, checkpoints

step.py holds PPOTrainer and its step, batches.py how a step's batch is drawn, fit.py the loop over the steps.
"""

from ppo.trainer.fit import NonFiniteStepsError
from ppo.trainer.step import PPOTrainer, ReferenceRoute, run_training

__all__ = ["NonFiniteStepsError", "PPOTrainer", "ReferenceRoute", "run_training"]
