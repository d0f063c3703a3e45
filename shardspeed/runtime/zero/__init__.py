"""DeepSpeed's ``deepspeed.runtime.zero`` import paths, for code ported with only the import
line changed. The implementation lives in :mod:`shardspeed.zero`; these modules re-export
what users import from here (the memory estimators)."""
