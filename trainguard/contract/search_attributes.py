"""trainguard's custom search attributes: their names and types, written once.

The job workflow upserts them (``workflows/job/visibility.py``), ``trainguard list`` and the UI
query them. A namespace must have them registered before a job runs: a workflow that upserts
an unregistered one fails its task forever. ``trainguard up`` registers them with its dev
server, ``trainguard setup`` in any namespace it may change, and the controller refuses to start
where one is missing (``trainguard.services.search_attributes``).
"""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

PHASE = SearchAttributeKey.for_keyword("TgPhase")
STEP = SearchAttributeKey.for_int("TgStep")
ETTR = SearchAttributeKey.for_float("TgEttr")
CODE_VERSION = SearchAttributeKey.for_keyword("TgCodeVersion")
INCIDENTS = SearchAttributeKey.for_int("TgIncidents")

ALL: tuple[SearchAttributeKey, ...] = (PHASE, STEP, ETTR, CODE_VERSION, INCIDENTS)

# Temporal's name of each key's type, as `temporal operator search-attribute create --type` takes it.
_TYPE_WORDS = {"KEYWORD": "Keyword", "INT": "Int", "DOUBLE": "Double", "TEXT": "Text", "BOOL": "Bool"}


def type_word(key: SearchAttributeKey) -> str:
    return _TYPE_WORDS[key.indexed_value_type.name]


# name -> Temporal's type word (`TgStep` -> `Int`).
TYPES: dict[str, str] = {k.name: type_word(k) for k in ALL}
