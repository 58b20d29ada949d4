import pytest

from rayapp.core.cascade import CascadeError, build_sampling_params, cascade, resolve_stopping
from rayapp.types import Sample, SamplingParams, StoppingCriteria

G = StoppingCriteria(max_turns=10, max_context_len=4096, timeout_s=600)
GS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=512)


def sample(dataset_cfg=None, name="ds"):
    meta = {"_dataset_name": name}
    if dataset_cfg is not None:
        meta["_dataset_cfg"] = dataset_cfg
    return Sample("t0", 0, "p", metadata=meta)


# (spec default, dataset cfg) -> expected; each row names the level that sets each field.
STOPPING_CASES = [
    ("global only", StoppingCriteria(), None, G),
    ("spec overrides global", StoppingCriteria(max_turns=3), None,
     StoppingCriteria(max_turns=3, max_context_len=4096, timeout_s=600)),
    ("dataset overrides global", StoppingCriteria(), {"max_context_len": 1024},
     StoppingCriteria(max_turns=10, max_context_len=1024, timeout_s=600)),
    ("dataset overrides spec", StoppingCriteria(max_turns=3), {"max_turns": 7},
     StoppingCriteria(max_turns=7, max_context_len=4096, timeout_s=600)),
    ("mixed: one field from each level", StoppingCriteria(max_context_len=2048), {"timeout_s": 30.0},
     StoppingCriteria(max_turns=10, max_context_len=2048, timeout_s=30.0)),
    ("dataset keys of the other struct and of the data source are left alone", StoppingCriteria(max_turns=2),
     {"temperature": 0.1, "weight": 3, "path": "x.jsonl"},
     StoppingCriteria(max_turns=2, max_context_len=4096, timeout_s=600)),
    ("empty dataset cfg", StoppingCriteria(), {}, G),
]


@pytest.mark.parametrize(("case", "spec_default", "cfg", "expected"), STOPPING_CASES,
                         ids=[c[0] for c in STOPPING_CASES])
def test_stopping_cascade(case, spec_default, cfg, expected):
    assert resolve_stopping(G, spec_default, sample(cfg)) == expected


SAMPLING_CASES = [
    ("global only", SamplingParams(), None, GS),
    ("spec sets temperature, dataset sets top_p and stop", SamplingParams(temperature=0.6),
     {"top_p": 0.9, "stop": ["</answer>"]},
     SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=512, stop=["</answer>"])),
    ("dataset beats spec on the same field", SamplingParams(temperature=0.6, seed=1), {"temperature": 0.0},
     SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=512, seed=1)),
]


@pytest.mark.parametrize(("case", "spec_default", "cfg", "expected"), SAMPLING_CASES,
                         ids=[c[0] for c in SAMPLING_CASES])
def test_sampling_cascade(case, spec_default, cfg, expected):
    assert build_sampling_params(GS, spec_default, sample(cfg)) == expected


def test_a_bad_dataset_value_names_the_dataset_and_the_field():
    with pytest.raises(CascadeError, match=r"^dataset 'gsm8k': \$\.dataset_cfg\.max_turns: expected int \| null, "
                                           r'got "many"$'):
        resolve_stopping(G, StoppingCriteria(), sample({"max_turns": "many"}, name="gsm8k"))
    with pytest.raises(CascadeError, match=r"^dataset 'gsm8k': \$\.dataset_cfg\.max_turns: expected int >= 1 and "
                                           r"<= 1000000, got 0$"):
        resolve_stopping(G, StoppingCriteria(), sample({"max_turns": 0}, name="gsm8k"))
    with pytest.raises(CascadeError, match=r"\$\.dataset_cfg\.top_k: expected -1 \(off\) or int >= 1, got 0$"):
        build_sampling_params(GS, SamplingParams(), sample({"top_k": 0}))
    with pytest.raises(CascadeError, match=r"\$\.dataset_cfg: expected an object of settings, got an array of 1 item$"):
        build_sampling_params(GS, SamplingParams(), sample(["temperature"]))


def test_cascade_needs_a_level_and_skips_missing_ones():
    assert cascade(None, StoppingCriteria(max_turns=1), None) == StoppingCriteria(max_turns=1)
    with pytest.raises(CascadeError):
        cascade(None, None)


def test_the_cascade_fields_are_every_field_of_the_two_cascaded_types():
    from rayapp.core.cascade import CASCADE_FIELDS

    assert set(CASCADE_FIELDS) == set(StoppingCriteria.__struct_fields__) | set(SamplingParams.__struct_fields__)
    assert len(CASCADE_FIELDS) == len(set(CASCADE_FIELDS))  # no field in both: a key says which level it sets
