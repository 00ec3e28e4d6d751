"""A replica's engine: requests, the scheduler, the engine core's step loop, the executor and
model runner, sampling, output processing and the asyncio front the replica actor serves from.
"""
