"""Each sampler knob is a generation option: SamplingSettings' fields are the one list."""

from __future__ import annotations

import dataclasses

from lucidlm.generation.request import make_request
from lucidlm.generation.sampling import SamplingSettings

VALUES = {"temperature": 0.5, "top_k": 3, "top_p": 0.5, "min_p": 0.1, "repetition_penalty": 1.2, "typical_p": 0.9,
          "epsilon_cutoff": 3e-4, "eta_cutoff": 2e-3, "no_repeat_ngram_size": 3, "suppress_tokens": (3, 5),
          "bad_words_ids": ((3,), (4, 5)), "sequence_bias": (((3, 4), -2.0),), "logit_bias": ((5, 1.5),),
          "presence_penalty": 0.5, "frequency_penalty": -0.5}


def test_every_sampling_field_is_a_checked_generation_option():
    names = [f.name for f in dataclasses.fields(SamplingSettings)]
    assert set(names) <= set(VALUES), "give the new sampler's field a valid value in VALUES"
    for name in names:
        settings = make_request({name: VALUES[name]}).settings
        assert getattr(settings, name) == VALUES[name]
    assert make_request({}).settings == SamplingSettings()  # unset: off, temperature 1
