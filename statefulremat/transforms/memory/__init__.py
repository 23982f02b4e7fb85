"""What a rematerialised computation keeps in memory: see README.md."""

from ._policy_check import CUSTOM_CHOICES as CUSTOM_CHOICES
from ._policy_check import Policy as Policy
from ._policy_check import custom_policy as custom_policy
