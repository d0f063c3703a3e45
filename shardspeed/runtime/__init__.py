"""shardspeed.runtime"""
