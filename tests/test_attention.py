"""Attention activations: the laws of SCIENCE.md figure A, name parsing, registry, causal masking."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precision_suite.training.attention import ATTENTIONS, get_attention, known_attentions, register_attention


@st.composite
def score_matrices(draw, max_tokens: int = 24, max_abs: float = 60.0) -> torch.Tensor:
    """A (heads, N, N) float32 score tensor with finite entries."""
    n = draw(st.integers(1, max_tokens))
    heads = draw(st.integers(1, 3))
    values = draw(
        st.lists(
            st.floats(-max_abs, max_abs, allow_nan=False, width=32),
            min_size=heads * n * n,
            max_size=heads * n * n,
        )
    )
    return torch.tensor(values, dtype=torch.float32).reshape(heads, n, n)


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@settings(max_examples=60, deadline=None)
@given(scores=score_matrices(), masked=st.booleans(), name=st.sampled_from(["softmax", "ssmax"]))
def test_softmax_family_norm_never_exceeds_sqrt_n(scores, masked, name):
    n = scores.shape[-1]
    attention = get_attention(name)(scores, n, causal(n) if masked else None)
    norms = torch.linalg.matrix_norm(attention.double(), ord="fro")
    # each row is a probability vector, so each row norm is <= 1
    assert bool((norms <= math.sqrt(n) * (1 + 1e-6)).all()), norms


@settings(max_examples=25, deadline=None)
@given(scores=score_matrices(max_tokens=10, max_abs=10.0))
def test_softmax_jacobian_frobenius_norm_at_most_two_sqrt_n(scores):
    row_block = scores[0].double()
    n = row_block.shape[-1]
    jacobian = torch.func.jacrev(lambda s: get_attention("softmax")(s, n, None))(row_block)
    assert float(torch.linalg.vector_norm(jacobian)) <= 2 * math.sqrt(n) + 1e-9


@settings(max_examples=40, deadline=None)
@given(scores=score_matrices(max_abs=4.0), power=st.integers(1, 4))
def test_polynomial_over_one_is_sqrt_n_times_its_scaled_twin(scores, power):
    n = scores.shape[-1]
    unscaled = get_attention(f"x^{power}/1")(scores, n, None)
    scaled = get_attention(f"x^{power}/sqrt(N)")(scores, n, None)
    torch.testing.assert_close(scaled * math.sqrt(n), unscaled, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize(
    ("name", "power", "divisor"),
    [("x/1", 1, 1.0), ("x/14", 1, 14.0), ("x^3/14", 3, 14.0), ("x^2/2.5", 2, 2.5), ("x^3/sqrt(N)", 3, None)],
)
def test_polynomial_names_parse_to_their_formula(name, power, divisor):
    scores = torch.linspace(-3, 3, 49).reshape(7, 7)
    expected = scores.pow(power) / (math.sqrt(7) if divisor is None else divisor)
    torch.testing.assert_close(get_attention(name)(scores, 7, None), expected)


@pytest.mark.parametrize("bad", ["x^0/1", "x/0", "x^-1/2", "x^3/sqrt(M)", "softmaxx", "", "x**3/1"])
def test_unknown_names_fail_with_the_known_ones(bad):
    with pytest.raises(ValueError) as error:
        get_attention(bad)
    message = str(error.value)
    assert repr(bad) in message
    for known in ("softmax", "sigmoid", "relu/N", "ssmax", "x^p/c"):
        assert known in message


@pytest.mark.parametrize("name", [*sorted(ATTENTIONS), "x/1", "x^3/sqrt(N)"])
def test_causal_mask_zeroes_the_future(name):
    n = 6
    scores = torch.randn(2, n, n, generator=torch.Generator().manual_seed(0))
    attention = get_attention(name)(scores, n, causal(n))
    assert bool((attention[..., ~causal(n)] == 0).all())
    unmasked = get_attention(name)(scores, n, None)
    if name in ("softmax", "ssmax"):  # renormalised over the visible keys
        torch.testing.assert_close(attention.sum(-1), torch.ones(2, n))
    else:  # element-wise: the visible entries are untouched
        torch.testing.assert_close(attention[..., causal(n)], unmasked[..., causal(n)])


def test_sigmoid_is_one_half_where_the_score_equals_log_n():
    n = 9
    scores = torch.full((n, n), math.log(n))
    torch.testing.assert_close(get_attention("sigmoid")(scores, n, None), torch.full((n, n), 0.5))


def test_relu_over_n_keeps_positive_scores_divided_by_n():
    n = 4
    scores = torch.tensor([[-1.0, 0.0, 2.0, 8.0]] * n)
    expected = torch.tensor([[0.0, 0.0, 0.5, 2.0]] * n)
    torch.testing.assert_close(get_attention("relu/N")(scores, n, None), expected)


def test_scalable_softmax_sharpens_softmax_by_log_n():
    n = 5
    scores = torch.linspace(-2, 2, n * n).reshape(n, n)
    expected = torch.softmax(scores * math.log(n), dim=-1)
    torch.testing.assert_close(get_attention("ssmax")(scores, n, None), expected)


def test_register_by_decorator_and_by_call():
    def doubled_softmax(scores, n_tokens, causal_mask):
        return 2 * get_attention("softmax")(scores, n_tokens, causal_mask)

    try:
        assert register_attention("test-doubled", doubled_softmax) is doubled_softmax

        @register_attention("test-identity")
        def identity(scores, n_tokens, causal_mask):
            return scores

        assert get_attention("test-identity") is identity
        assert get_attention("test-doubled") is doubled_softmax
        assert "test-identity" in known_attentions()
    finally:
        ATTENTIONS.pop("test-doubled", None)
        ATTENTIONS.pop("test-identity", None)


@pytest.mark.parametrize(
    ("name", "fn", "error"), [("x/3", len, ValueError), ("", len, ValueError), ("ok", 3, TypeError)]
)
def test_register_rejects_polynomial_names_empty_names_and_non_callables(name, fn, error):
    with pytest.raises(error):
        register_attention(name, fn)
    assert name not in ATTENTIONS
