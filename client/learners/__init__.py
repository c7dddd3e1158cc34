"""Learners, one module per algorithm (DQN, PPO, ALLO); `replayd.client.learner` is their command line and
`replayd.client.learners.common` what they share (progress, evaluation, the run folder)."""
