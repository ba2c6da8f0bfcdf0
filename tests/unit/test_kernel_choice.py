"""The CPU linear kernels' choice from timings (``kernel_choice``, no clock of its own): fed made-up timings,
it picks the fastest per shape and row bucket, never a candidate that failed, and oneDNN unless another
beat it; the cache key changes with the CPU."""

from __future__ import annotations

from zserve.generator import kernel_choice as kc

A, B = kc.native("avx2", "6x2"), kc.native("avx2", "4x3")


def test_it_picks_the_fastest_candidate():
    assert kc.choose({kc.ONEDNN: 2.0, kc.TORCH: 3.0, A: 1.0, B: 1.5}) == A
    assert kc.choose({kc.ONEDNN: 2.0, kc.TORCH: 1.2, A: 1.5}) == kc.TORCH


def test_it_falls_back_to_onednn_when_a_variant_is_slower_failed_or_ties():
    assert kc.choose({kc.ONEDNN: 1.0, A: 1.4, B: 9.0}) == kc.ONEDNN  # slower
    assert kc.choose({kc.ONEDNN: 1.0, A: None, B: None}) == kc.ONEDNN  # did not build / raised / wrong
    assert kc.choose({kc.ONEDNN: 1.0, A: 1.0}) == kc.ONEDNN  # a tie keeps the reference
    assert kc.choose({kc.ONEDNN: 1.0, A: 0.98}) == kc.ONEDNN  # and so does a gain within the noise
    assert kc.choose({kc.ONEDNN: 1.0, A: 0.96}) == A
    assert kc.choose({kc.ONEDNN: None, A: 2.0, kc.TORCH: 3.0}) == A  # oneDNN failed: the fastest that ran
    assert kc.choose({kc.ONEDNN: 1.0, A: float("nan")}) == kc.ONEDNN
    assert kc.choose({}) == kc.ONEDNN


def test_the_fastest_routes_send_each_row_count_to_the_nearest_measured_bucket():
    timings = {
        "576->576": {1: {kc.ONEDNN: 2.0, A: 1.0}, 4: {kc.ONEDNN: 2.0, B: 1.0}, 64: {kc.ONEDNN: 1.0, A: 1.1},
                     512: {kc.ONEDNN: 2.0, kc.TORCH: 1.0, A: None}},
    }  # fmt: skip
    route = kc.fastest_routes(timings)["576->576"]
    assert route.rows == (1, 4, 64, 512)
    assert route.kinds == (A, B, kc.ONEDNN, kc.TORCH)
    # limits at the geometric means: 2, 16, ~181
    assert [route.kind(r) for r in (1, 2, 3, 16, 17, 181, 182, 100_000)] == [A, A, B, B, kc.ONEDNN, kc.ONEDNN,
                                                                           kc.TORCH, kc.TORCH]  # fmt: skip
    assert route.needs() == {A, B, kc.ONEDNN, kc.TORCH}


def test_the_measured_speedup_is_onednns_time_over_the_chosen_and_never_below_one():
    timings = {
        "a": {1: {kc.ONEDNN: 3.0, A: 1.0}, 8: {kc.ONEDNN: 1.0, A: 4.0}},
        "b": {1: {kc.ONEDNN: 1.0, A: 1.0}, 8: {kc.ONEDNN: 1.0, A: None, kc.TORCH: 0.5}},
    }
    routes = kc.fastest_routes(timings)
    ratios = kc.speedup(timings, routes)
    assert ratios == {1: 4.0 / 2.0, 8: 2.0 / 1.5}
    line = kc.summary(routes, ratios, cached=False)
    assert "a: 1:avx2/6x2, 8:onednn" in line and "1 rows 2.00x" in line and "8 rows 1.33x" in line


def test_the_cache_key_includes_the_cpu_the_source_threads_shapes_and_versions():
    base = dict(cpu="x86_64 AMD EPYC flags avx2 fma", source="int f;", threads=1, shapes=["576->576"], rows=[1, 8],
                versions="torch 2")  # fmt: skip
    key = kc.cache_key(**base)
    assert kc.cache_key(**base) == key
    for field, other in (("cpu", "x86_64 AMD EPYC flags avx2 fma avx512f"), ("source", "int g;"), ("threads", 2),
                         ("shapes", ["576->1536"]), ("rows", [1, 64]), ("versions", "torch 3")):  # fmt: skip
        assert kc.cache_key(**(base | {field: other})) != key, field


def test_a_choice_survives_its_cache_file():
    routes = kc.fastest_routes({"s": {1: {kc.ONEDNN: 2.0, A: 1.0}, 64: {kc.ONEDNN: 1.0}}})
    again, ratios = kc.from_json(kc.to_json(routes, {1: 2.0, 64: 1.0}))
    assert again == routes and ratios == {1: 2.0, 64: 1.0}


def test_buckets_are_sorted_unique_and_start_at_one():
    assert kc.buckets(64, 4, 512, 4, 0) == (1, 4, 64, 512)


def test_a_quantised_layer_takes_int8_activations_where_they_measured_faster_over_the_row_counts():
    fp32, int8 = kc.FP32, kc.INT8
    assert kc.choose_activations({1: {fp32: 2.0, int8: 1.0}, 32: {fp32: 4.0, int8: 2.0}}) == int8
    # one layout of the weights serves every row count: the geometric mean of the ratios decides
    assert kc.choose_activations({1: {fp32: 1.0, int8: 0.5}, 32: {fp32: 1.0, int8: 1.5}}) == int8  # sqrt(0.75)
    assert kc.choose_activations({1: {fp32: 1.0, int8: 0.5}, 32: {fp32: 1.0, int8: 2.5}}) == fp32  # sqrt(1.25)
    assert kc.choose_activations({1: {fp32: 1.0, int8: 0.98}}) == fp32  # within the noise: the fp32 kernel
    assert kc.choose_activations({1: {fp32: 1.0, int8: 0.5}, 8: {fp32: 1.0, int8: None}}) == fp32  # int8 failed
    assert kc.choose_activations({1: {fp32: None, int8: 0.5}}) == int8  # fp32 failed
    assert kc.choose_activations({}) == fp32


def test_the_int8_layout_runs_fp32_activations_from_the_buckets_int8_lost_at_the_top():
    int8, split, never = kc.INT8, kc.INT8_LAYOUT_FP32, kc.NEVER
    t = {1: {int8: 1.0, split: 3.0}, 8: {int8: 2.0, split: 2.5}, 32: {int8: 6.0, split: 5.0},
         128: {int8: 30, split: 20}}  # fmt: skip
    assert kc.split_rows(t) == 17  # past sqrt(8 * 32) = 16, as Route's limits
    assert kc.split_rows(t | {8: {int8: 3.0, split: 2.5}}) == 3  # sqrt(1 * 8) = 2.8
    assert kc.split_rows(t | {128: {int8: 20.0, split: 20.0}}) == never  # int8 held the largest bucket
    assert kc.split_rows(t | {32: {int8: 5.0, split: 5.0}}) == 65  # only the buckets above the last int8 held
    assert kc.split_rows(t | {1: {int8: 4.0, split: 3.0}, 8: {int8: 3.0, split: 2.5}}) == 1  # fp32 won everywhere
    assert kc.split_rows(t | {128: {int8: None, split: 20.0}}) == 17  # int8 failed there: lost it
    assert kc.split_rows(t | {128: {int8: 30.0, split: None}}) == never
    assert kc.split_rows({1: {int8: 1.0}}) == never  # not timed: never


def test_the_split_is_not_put_below_the_rows_of_a_path_no_timing_measured():
    int8, split = kc.INT8, kc.INT8_LAYOUT_FP32
    # fp32 won from 8 rows on, timed there on the path of 6 rows and more (4-bit on AVX2): from 6, not from 3
    t = {1: {int8: 1.0, split: 2.0}, 8: {int8: 3.0, split: 2.5}, 32: {int8: 6.0, split: 5.0},
         128: {int8: 30, split: 20}}  # fmt: skip
    assert kc.split_rows(t) == 3 and kc.split_rows(t, 6) == 6 and kc.split_rows(t, 8) == 8
    assert kc.split_rows(t, 12) == 3  # 8 rows timed below 12: on the path that 3-7 rows run (8-bit weights)
    assert kc.split_rows(t | {8: {int8: 2.0, split: 2.5}}, 6) == 17  # above it already
    assert kc.split_rows(t | {1: {int8: 3.0, split: 2.0}}, 6) == 1  # 1 row won too, timed on the path below 6
    assert kc.split_rows(t | {128: {int8: 20, split: 20}}, 6) == kc.NEVER


def test_the_int8_layout_is_kept_where_its_split_makes_it_faster_over_the_row_counts():
    fp32, int8, split = kc.FP32, kc.INT8, kc.INT8_LAYOUT_FP32
    # int8 alone loses (geometric mean of 0.5, 1.0, 2.0, 2.0 = 1.19); run fp32 activations at 32 and 128, it wins
    t = {1: {fp32: 2, int8: 1, split: 3}, 8: {fp32: 2, int8: 2, split: 2.2}, 32: {fp32: 4, int8: 8, split: 4.1},
         128: {fp32: 10, int8: 20, split: 10}}  # fmt: skip
    assert kc.choose_activations({r: {fp32: v[fp32], int8: v[int8]} for r, v in t.items()}) == fp32
    assert kc.split_rows(t) == 17 and kc.choose_activations(t) == int8
    # int8 failing anywhere (a wrong result) keeps the fp32 kernel, as without a split
    assert kc.choose_activations(t | {128: {fp32: 10, int8: None, split: 10}}) == fp32
    assert kc.choose_activations(t | {8: {fp32: 2, int8: None, split: 2.2}}) == fp32


def test_the_split_moves_only_where_fp32_activations_won_clear_of_the_noise():
    int8, split = kc.INT8, kc.INT8_LAYOUT_FP32
    t = {1: {int8: 1.0, split: 2.0}, 8: {int8: 1.0, split: 0.92}, 32: {int8: 1.0, split: 0.8},
         128: {int8: 1.0, split: 0.7}}  # fmt: skip
    # 0.92 at 8 rows (or 1.06: AVX2, 4-bit, one allocation to the next): int8 keeps it, the split stays at 17
    assert kc.split_rows(t, 6) == kc.split_rows(t | {8: {int8: 1.0, split: 1.06}}, 6) == 17
    assert kc.split_rows(t | {8: {int8: 1.0, split: 0.89}}, 6) == 6  # clear of it
    assert kc.split_rows(t | {128: {int8: 1.0, split: 0.91}}) == kc.NEVER
