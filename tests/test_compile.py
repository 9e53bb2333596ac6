"""``--compile`` (each block compiled with torch.compile, as torchtitan does) in the steps whose
communication stays outside the blocks. Step 6's gradient hooks, reduce-scatter and sharded
optimiser compose with compiled blocks as PyTorch's DDP does: bitwise step 1 compiled. And the
compiled blocks really ran: their fused kernels round differently from eager ones, within step 1's
parity limits. The steps where it is refused: docs/bad_input.md.
"""

from conftest import assert_bitwise_same_run, parity, train


def test_compiled_blocks_compose_with_hooks_and_sharding(tmp_path, small_corpus):
    compiled = train(
        "step1", tmp_path / "step1_compiled", small_corpus, "--steps", "3", "--compile"
    )
    zero2 = train("step6", tmp_path / "step6_compiled", small_corpus, "--steps", "3", "--compile")
    eager = train("step1", tmp_path / "step1_eager", small_corpus, "--steps", "3")
    assert_bitwise_same_run(compiled, zero2)
    result = parity(compiled, eager)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "bitwise identical" not in result.stdout, (
        "the compiled run is the eager one: nothing was compiled"
    )
