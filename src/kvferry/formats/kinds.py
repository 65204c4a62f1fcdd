"""The engine KV layouts kvferry knows, by LMCache's names and ids."""

from __future__ import annotations

from enum import IntEnum


class EngineKVFormat(IntEnum):
    """Paged KV-cache layouts as engines hand them over (ids 0-18 are LMCache's).

    `X` in a name is a Python list level (one tensor per element); `_` a dimension inside one tensor.
    Ids from 100 up are kvferry's own, for layouts LMCache has not numbered.
    """

    NB_NL_TWO_BS_NH_HS = 0
    NL_X_TWO_NB_BS_NH_HS = 1
    NL_X_NB_TWO_BS_NH_HS = 2
    NL_X_NB_BS_HS = 3
    TWO_X_NL_X_NBBS_NH_HS = 4
    NL_X_NBBS_ONE_HS = 5
    NL_X_TWO_NB_NH_BS_HS = 6
    NL_X_NB_TWO_NH_BS_HS = 7
    NB_NL_TWO_NH_BS_HS = 8
    TWO_X_NL_X_NB_BS_NH_HS = 9
    NL_X_NB_NH_BS_TWO_HS = 10
    NL_X_NB_BS_NH_TWO_HS = 11
    NL_X_NB_NH_BS_CS = 12
    NL_X_NB_BS_NH_CS = 13
    NL_X_NB_BSV_BSS = 14
    NL_X_TWO_NB_NH_ONE_BS_HS = 15
    NL_X_TWO_X_NB_BS_NH_HS = 16
    NL_X_NP_X_NB_BS_ONE_HS = 17
    NL_X_NB_BS_NH_HS = 18
    # kvferry's own ids: layouts seen in engines that LMCache has not numbered yet.
    NB_NL_NH_BS_CS = 100
    NB_NL_BS_NH_CS = 101
    VLLM_CPU_NL_X_NB_NH_KT_V = 102
    VLLM_CPU_AMX_NL_X_NB_NH_KV_TILED = 103
