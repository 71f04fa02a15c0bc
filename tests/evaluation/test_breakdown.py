from paperback.evaluation.breakdown import breakdown


def point(name, bits, kl):
    return {"format": name, "bits_per_element": bits, "kl": kl}


def test_knee_is_where_a_flat_curve_turns_steep():
    points = [point("b8", 9, 1e-4), point("b2", 3, 0.9), point("b4", 5, 0.01), point("b3", 4, 0.05)]
    result = breakdown(points)
    assert result["knee"] == "b3"
    assert result["recommended"] == "b4" and result["margin_steps"] == 1
    assert breakdown(points, margin_steps=5)["recommended"] == "b8"


def test_gradual_curve_puts_the_knee_before_the_steepest_part():
    points = [point(f"b{b}", b, kl) for b, kl in ((8, 0.001), (6, 0.004), (5, 0.01), (4, 0.3), (3, 1.0))]
    assert breakdown(points)["knee"] == "b5"


def test_degenerate_inputs():
    assert breakdown([]) == {"knee": None, "recommended": None}
    assert breakdown([point("only", 8, 0.1)])["recommended"] == "only"
    assert breakdown([point("hi", 8, 0.0), point("lo", 4, 0.5)])["knee"] == "hi"
