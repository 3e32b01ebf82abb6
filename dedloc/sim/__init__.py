"""The swarm simulator: many peers' real daemon code in one process, on virtual time.

- loop.py: `VirtualClockLoop`, asyncio on virtual time (`run_virtual`);
- network.py: `SimNetwork`, hosts with latency and bandwidth, partitions; `SimTransport`, the
  daemon's transport with real links over in-memory pipes;
- trainer.py: `VectorTrainer`, the engine's trainer made of vectors;
- swarm.py: `Swarm` of `SimPeer`s, each composed of the real DHT, averager, state sharing and run
  engine;
- scenarios.py: the scripted scenarios and what they measure (`python -m dedloc.sim`).
"""
