"""What a rematerialised computation keeps in memory: see README.md."""

from ._policy_check import Policy as Policy
