"""The simulator's compiled decode loops, checked by hand on a few requests."""

import numpy as np

from moeinfra.serving.decode_batch import admit_ready, advance_batch, batch_load

RUNNING, COMPLETED, REJECTED = 1, 0, 2
EMPTY_I, EMPTY_F = np.zeros(0, dtype=np.int64), np.zeros(0)


def test_admission_fills_the_least_loaded_unit_until_its_kv_is_full_and_rejects_the_late():
    # requests 0..4 each need (input + output / 2) x scale = (90 + 10) x 2 = 200 KV tokens
    inputs = np.array([90, 90, 90, 90, 90, 50], dtype=np.int32)
    outputs = np.array([20, 20, 20, 20, 20, 4], dtype=np.int32)
    # unit 1 already runs request 5: (50 + 2 tokens done) x 2 = 104 KV tokens
    a_idx, a_unit = np.array([5]), np.array([1])
    a_done, a_from = np.array([2.0]), np.array([0.0])
    pend = np.array([4, 0, 1, 2, 3])
    # ready at: request 4 9 s, 0 -500 s (waiting since), 1 2 s, 2 1 s, 3 12 s (after t1 = 10)
    ready = np.array([9.0, -500.0, 2.0, 1.0, 12.0])
    args = (inputs, outputs, EMPTY_I, 2, 3, 2.0)  # no home unit; 2 of 3 units run; scale 2

    def admit(kv_cap):
        status, reason = np.full(6, RUNNING, dtype=np.int8), np.full(6, -1, dtype=np.int8)
        out = admit_ready(
            pend, ready, 8.0, 10.0, a_idx, a_unit, a_done, a_from, *args, kv_cap, np.inf, 300.0,
            status, reason, REJECTED,
        )  # fmt: skip
        return *out, status, reason

    # earliest first (0, 2, 1, 4): water-filling 800 tokens over levels (0, 104) to 452 puts
    # the first two on unit 0 and the last two on unit 1; at 410 per unit, unit 1 holds one
    idx, unit, done, since, waiting, status, _ = admit(410.0)
    assert idx.tolist() == [5, 0, 2, 1] and unit.tolist() == [1, 0, 0, 1]
    assert done.tolist() == [2.0, 1.0, 1.0, 1.0]
    assert since.tolist() == [0.0, 8.0, 8.0, 8.0]  # ready before t0: from t0
    assert waiting.tolist() == [4, 3]  # did not fit or not ready: waiting on, in order
    assert (status == RUNNING).all()

    # at 100 per unit none fits: request 0, waiting 510 s > 300, is rejected; the others wait
    idx, _, _, _, waiting, status, reason = admit(100.0)
    assert idx.tolist() == [5]
    assert status[0] == REJECTED and reason[0] == 1 and (status[1:] == RUNNING).all()
    assert waiting.tolist() == [4, 1, 2, 3]


def test_a_batch_limit_admits_only_what_the_unit_may_run():
    inputs = np.full(3, 10, dtype=np.int32)
    outputs = np.full(3, 10, dtype=np.int32)
    status, reason = np.full(3, RUNNING, dtype=np.int8), np.full(3, -1, dtype=np.int8)
    idx, *_ = admit_ready(
        np.arange(3), np.zeros(3), 0.0, 1.0, EMPTY_I, EMPTY_I, EMPTY_F, EMPTY_F, inputs, outputs,
        EMPTY_I, 1, 1, 1.0, np.inf, 2.0, 300.0, status, reason, REJECTED,
    )  # fmt: skip
    assert idx.tolist() == [0, 1]


def test_the_batch_load_and_the_advance_of_two_requests_by_hand():
    inputs = np.array([100, 200], dtype=np.int32)
    outputs = np.array([4, 50], dtype=np.int32)
    a_idx, a_unit = np.array([0, 1]), np.array([0, 0])
    a_done, a_from = np.array([2.0, 10.0]), np.array([0.0, 0.5])
    last_step = np.array([0.1])
    run_s, remaining, count, kv = batch_load(
        a_idx, a_unit, a_done, a_from, inputs, outputs, last_step, 2.0, 2.0, 1.0, 1
    )
    assert run_s.tolist() == [2.0, 1.5] and remaining.tolist() == [2.0, 40.0]
    # request 0 finishes after 2 steps of 0.1 s: in the batch for 0.2 s of the 2-s tick
    assert count[0] == 0.1 + 0.75
    assert kv[0] == 0.1 * 102 + 0.75 * 210

    first_token = np.array([-1.0, -5.0])
    finish, tpot = np.full(2, np.nan), np.full(2, np.nan)
    status = np.full(2, RUNNING, dtype=np.int8)
    step = np.array([0.1])
    running, produced, whole, kv_sum, unit_tokens, started = advance_batch(
        a_idx, a_unit, a_done, a_from, run_s, remaining, np.array([0.0, 0.5]), step, 1.0, 2.0,
        inputs, outputs, first_token, finish, tpot, status, COMPLETED, 1,
    )  # fmt: skip
    assert running == 1 and a_idx[0] == 1 and a_from[0] == 2.0
    assert a_done[0] == 20.0  # (1.5 - 0.5 held) / 0.1 = 10 tokens
    assert produced == 12.0 and unit_tokens[0] == 12.0 and started[0] == 2
    assert whole == 12  # whole tokens: 2 to finish request 0, 10 more of request 1
    assert kv_sum == 2 * (102 + 1) + 10 * (210 + 5)
    assert status.tolist() == [COMPLETED, RUNNING]
    assert finish[0] == 0.2 and tpot[0] == (0.2 + 1.0) / 3
