"""Actors, one module per algorithm: DQN (epsilon-greedy episodes), PPO (on-policy rollouts), ALLO
(random-walk episodes). `replayd.client.actor` is their command line; `replayd.client.actors.common` what they share."""
