"""shardspeed.zero"""
