"""The Master's threads: SFT and rollout producers, the advantage stage and the actor loop."""
