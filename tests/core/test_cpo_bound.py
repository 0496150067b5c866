"""``benchmarks/cpo_bound.py``'s count of the kernels one execution runs, against a hand count of a small
HLO module: free instructions (parameter, constant, tuple, get-tuple-element, bitcast) left out, a fused
computation's instructions not counted (they are one kernel), a while body counted once per trip and its
condition once more, a known trip count read from the loop's backend config."""
from __future__ import annotations

import sys

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from cpo_bound import executed_kernels  # noqa: E402

HLO = """HloModule jit_f, is_scheduled=true

%fused_computation (param_0: f32[64]) -> f32[64] {
  %param_0 = f32[64]{0} parameter(0)
  %sin.1 = f32[64]{0} sine(%param_0)
  ROOT %sin.0 = f32[64]{0} sine(%sin.1)
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64]{0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[64]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %z = f32[64]{0} copy(%y)
  ROOT %t = (s32[], f32[64]{0}) tuple(%next, %z)
}

%cond (p.1: (s32[], f32[64])) -> pred[] {
  %p.1 = (s32[], f32[64]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x.1: f32[64]) -> f32[64] {
  %x.1 = f32[64]{0} parameter(0)
  %zero = s32[] constant(0)
  %a = f32[64]{0} fusion(%x.1), kind=kLoop, calls=%fused_computation
  %init = (s32[], f32[64]{0}) tuple(%zero, %a)
  %w = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  %w2 = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[64]{0} get-tuple-element(%w), index=1
}
"""


def test_kernels_counted_by_hand():
    got = executed_kernels(HLO, while_trips=3)
    # entry: fusion %a, while %w, while %w2 = 3 kernels; body: add, fusion, copy = 3; cond: compare = 1
    # %w: 7 trips (known) -> 7 * 3 + 8 * 1 = 29; %w2: no known count -> while_trips = 3 -> 3 * 3 + 4 * 1 = 13
    assert got["entry"] == 3
    assert got["executed"] == 3 + 29 + 13
    assert [(w["trips"], w["body_kernels"]) for w in got["while_loops"]] == [(7, 3), (3, 3)]
    assert got["while_loops"][0]["body_kernels_with_a_product"] == 0
