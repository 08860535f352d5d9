"""The host side: queues, admission, KV bookkeeping and the radix cache; what a sampled token does
to a request. It decides what runs and emits plain data (engine/batch.py ScheduleBatch); it never
writes the device."""
