"""Example training scripts shipped with axond."""
