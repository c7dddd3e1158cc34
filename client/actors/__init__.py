"""Actors, one module per algorithm: DQN (epsilon-greedy episodes), PPO (on-policy rollouts), ALLO
(random-walk episodes). `client.actor` is their command line; `client.actors.common` what they share."""
