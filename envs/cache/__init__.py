"""The cache stage: what the LLMs did, stored and checked (docs/caches.md).

- :mod:`envs.cache.schema`: the manifest, the ``[Q, T]`` arrays, checksums and the fast format;
- :mod:`envs.cache.jsonl`: the human format (JSON Lines); :mod:`envs.cache.journal`: a gateway journal's lines;
- :mod:`envs.cache.formats`: ``load_cache`` / ``save_cache`` above both formats;
- :mod:`envs.cache.values`: the value rules every reader and writer applies;
- :mod:`envs.cache.normalise`: when two answers are the same answer;
- :mod:`envs.cache.atomic`: atomic writes of files and directories;
- :mod:`envs.cache.tokens`: the one token estimate (four characters a token).

The bottom stage of ``envs``: it imports no other stage (pyproject's import-linter contracts).
"""
