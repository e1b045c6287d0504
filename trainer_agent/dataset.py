"""``trainer_agent.dataset``, as documented: the code lives in ``trainer_agent.data.sharded_dataset``."""

from trainer_agent.data.sharded_dataset import *  # noqa: F403 - a documented import path
from trainer_agent.data.sharded_dataset import __all__  # noqa: F401
