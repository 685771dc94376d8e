"""collector.py: what Python's garbage collector may reclaim inside and after each block, seen
through weak references to unreachable reference cycles (only the cyclic collector frees
those), and the freeze counts CPython itself reports. Each scenario runs in a fresh
interpreter: the test session's own objects may already be frozen (the command line freezes
its process, and some tests run it in this one)."""

import json
import subprocess
import sys

SETUP = """
import gc, json, weakref
from lucidlm import collector
gc.disable()  # only the scenario's explicit gc.collect() calls collect

class Node:
    pass

def garbage():
    node = Node()
    node.me = node  # a reference cycle: freed by the cyclic collector only
    return weakref.ref(node)
"""


def run(scenario: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SETUP + scenario], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_older_objects_frozen_collects_only_new_garbage_inside_and_everything_after():
    seen = run("""
made_before = garbage()
with collector.older_objects_frozen():
    frozen_inside = gc.get_freeze_count()
    made_inside = garbage()
    gc.collect()
    inside = {"made_inside_freed": made_inside() is None, "made_before_freed": made_before() is None}
frozen_after = gc.get_freeze_count()
gc.collect()
print(json.dumps(dict(inside, frozen_inside=frozen_inside, frozen_after=frozen_after,
                      made_before_freed_after=made_before() is None)))
""")
    assert seen["frozen_inside"] > 1000  # every object of the interpreter and its imports
    assert seen["made_inside_freed"] and not seen["made_before_freed"]
    assert seen["frozen_after"] == 0 and seen["made_before_freed_after"]


def test_older_objects_frozen_leaves_someone_elses_freeze_alone():
    seen = run("""
kept = garbage()
gc.freeze()  # e.g. a server before it forks
frozen = gc.get_freeze_count()
with collector.older_objects_frozen():
    made_inside = garbage()
frozen_after = gc.get_freeze_count()
gc.collect()
print(json.dumps({"thawed": frozen_after < frozen, "kept": kept() is not None, "made_inside_freed": made_inside() is None}))
""")
    assert not seen["thawed"] and seen["kept"] and seen["made_inside_freed"]


def test_kept_until_exit_turns_collection_off_inside_and_freezes_for_good():
    seen = run("""
gc.enable()
with collector.kept_until_exit():
    enabled_inside = gc.isenabled()
    made_inside = garbage()
frozen = gc.get_freeze_count()
gc.collect()
with collector.older_objects_frozen():  # inside a frozen process: nothing to thaw afterwards
    pass
print(json.dumps({"enabled_inside": enabled_inside, "enabled_after": gc.isenabled(),
                  "made_inside_kept": made_inside() is not None, "still_frozen": gc.get_freeze_count() == frozen}))
""")
    assert not seen["enabled_inside"] and seen["enabled_after"]
    assert seen["made_inside_kept"] and seen["still_frozen"]


def test_load_builds_the_model_with_the_older_objects_frozen():
    seen = run("""
import lucidlm, lucidlm.loading as loading
counts = []
base = loading._load_base
def spy(*args, **kwargs):
    counts.append(gc.get_freeze_count())
    return base(*args, **kwargs)
loading._load_base = spy
model = lucidlm.load("llama", random_init=True, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_mlp=64,
                     vocab_size=64, max_seq_len=16)
print(json.dumps({"inside": counts, "after": gc.get_freeze_count()}))
""")
    assert len(seen["inside"]) == 1 and seen["inside"][0] > 10000  # torch's objects among them
    assert seen["after"] == 0
