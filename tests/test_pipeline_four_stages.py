"""Step 9 at four stages with the 1F1B schedule, from the first step: bitwise equal to step 0
accumulating the same micro-batches (tests/test_pipeline_parallel.py has two stages with both
schedules, and four with GPipe after a resume). One flush of 4 micro-batches: stage s warms up with
3 - s forwards, so every stage runs a different interleaving of forwards and backwards, with
dropout, bf16 autocast and clipping on."""

from conftest import TINY, assert_bitwise_same_run, train

FLAGS = (*TINY, "--n-layer", "4", "--grad-accum", "4", "--dropout", "0.1", "--amp", "bf16")


def test_four_stages_1f1b_train_bitwise_like_step0(tmp_path, small_corpus):
    step0 = train("step0", tmp_path / "step0", small_corpus, *FLAGS)
    four = train("step9", tmp_path / "four", small_corpus, *FLAGS, "--schedule", "1f1b", nproc=4)
    assert_bitwise_same_run(step0, four)


def test_four_stages_with_fewer_micro_batches_than_stages_train_bitwise_like_step0(
    tmp_path, small_corpus
):
    """M = 2 < P = 4: 1F1B's warm-up must stop at M forwards (stage 0 would otherwise wait for a
    third forward that never comes, or drop a backward), and GPipe's whole flush is two
    micro-batches. Dropout on: a skipped or repeated micro-batch would draw other masks."""
    flags = (*TINY, "--n-layer", "4", "--grad-accum", "2", "--dropout", "0.1")
    step0 = train("step0", tmp_path / "step0", small_corpus, *flags)
    for schedule in ("1f1b", "gpipe"):
        four = train(
            "step9", tmp_path / schedule, small_corpus, *flags, "--schedule", schedule, nproc=4
        )
        assert_bitwise_same_run(step0, four)
