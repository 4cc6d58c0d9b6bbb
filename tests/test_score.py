"""Teacher-forced scoring equals the reference computation of each mode, row by row and in ragged batches."""

from __future__ import annotations

import pytest
import torch

from conftest import random_ids, tiny_model
from fullband.decode.score import score
from fullband.errors import InputError


def _ref(model, ctx: list[int], cont: list[int], mode: str) -> tuple[float, bool]:
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        if mode == "standard":
            logits = model(ids, passes=1).logits[0]
        elif mode == "soft":
            logits = model.recurrent_forward(ids, plain_prefix=len(ctx)).logits[0]
        else:
            logits = model.recurrent_forward(ids).logits[0]
    logp = torch.log_softmax(logits.double(), -1)[len(ctx) - 1 : -1]
    target = torch.tensor(cont)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


@pytest.mark.parametrize("mode", ["standard", "soft", "exact"])
def test_score_equals_the_reference_in_ragged_batches(mode):
    model = tiny_model()
    rows = [(random_ids(1, 7, seed=1)[0].tolist(), random_ids(1, 4, seed=2)[0].tolist()),
            (random_ids(1, 12, seed=3)[0].tolist(), random_ids(1, 1, seed=4)[0].tolist()),
            (random_ids(1, 3, seed=5)[0].tolist(), random_ids(1, 6, seed=6)[0].tolist())]
    got = score(model, [c for c, _ in rows], [x for _, x in rows], mode=mode)
    for (ctx, cont), (lp, greedy) in zip(rows, got):
        ref_lp, ref_greedy = _ref(model, ctx, cont, mode)
        assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy


def test_score_fused_first_token_reads_k_prefill_passes_and_greedy_flag():
    model = tiny_model()
    ctx = random_ids(1, 9, seed=7)[0].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([ctx]), passes=3).logits[0, -1]
    logp = torch.log_softmax(logits.double(), -1)
    best = int(logp.argmax())
    (lp, greedy), (lp2, greedy2) = score(model, [ctx, ctx], [[best], [(best + 1) % 256]], mode="fused",
                                         prefill_passes=2)
    assert lp == pytest.approx(float(logp[best]), abs=1e-6) and greedy
    assert lp2 == pytest.approx(float(logp[(best + 1) % 256]), abs=1e-6) and not greedy2


def test_score_rejects_bad_input():
    model = tiny_model()
    with pytest.raises(InputError, match="at least one token"):
        score(model, [[1, 2]], [[]])
    with pytest.raises(InputError, match="2 contexts but 1"):
        score(model, [[1], [2]], [[3]])
    with pytest.raises(InputError, match="outside 0 <= id"):
        score(model, [[1]], [[100000]])
