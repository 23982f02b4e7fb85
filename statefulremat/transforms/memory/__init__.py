"""What a rematerialised computation keeps in memory: see README.md."""

from ._named_policies import Policy as Policy
