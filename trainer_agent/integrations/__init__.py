"""One-line callbacks for training frameworks, each in its own module so that importing
``trainer_agent`` (or this package) imports no framework:

- ``trainer_agent.integrations.hf.TrainguardCallback``: the Hugging Face ``transformers.Trainer``
  (extra ``trainguard[hf]``);
- ``trainer_agent.integrations.lightning.TrainguardCallback``: Lightning's ``Trainer``
  (extra ``trainguard[lightning]``).
"""
