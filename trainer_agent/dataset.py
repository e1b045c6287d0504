"""``trainer_agent.dataset``, as documented: the sharded token dataset. The code lives in
``trainer_agent/data/``: ``shard_files.py`` (the files of a shard: writer and reader),
``sharded_dataset.py`` (the order, the seeds, a rank's batches) and ``token_loader.py`` (the
loader: prefetch, resume, quarantine)."""

from trainer_agent.data.shard_files import ShardInfo, ShardWriter, TokenShard, byte_tokenizer, write_shards
from trainer_agent.data.sharded_dataset import Permutation, TokenBatches, worker_seed
from trainer_agent.data.token_loader import TokenLoader

__all__ = ["ShardWriter", "ShardInfo", "TokenShard", "TokenBatches", "TokenLoader", "write_shards", "worker_seed",
           "Permutation", "byte_tokenizer"]
