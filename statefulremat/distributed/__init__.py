"""The distributed floor: logical sharding rules, ``sr.shard``, partition specs."""
