"""Torch learners that consume replayd batches (dicts of tensors): DQN / Double DQN, ALLO, PPO."""

from replayd.client.trainers.allo import AlloEncoder, AlloTrainer, allo_loss, update_duals_and_barrier
from replayd.client.trainers.dqn import DQNTrainer, q_loss, update_target
from replayd.client.trainers.dqn_manual_grad import q_loss_manual_grad
from replayd.client.trainers.ppo import ActorCritic, PPOTrainer, ppo_loss
from replayd.client.trainers.q_network import QNetwork

__all__ = [
    "ActorCritic",
    "AlloEncoder",
    "AlloTrainer",
    "DQNTrainer",
    "PPOTrainer",
    "QNetwork",
    "allo_loss",
    "ppo_loss",
    "q_loss",
    "q_loss_manual_grad",
    "update_duals_and_barrier",
    "update_target",
]
