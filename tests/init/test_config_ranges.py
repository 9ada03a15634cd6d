"""Bad values give one clear line each: every environment variable is range-checked, long lists of ranks are
summarised, and the failure hook composes with a user's `sys.excepthook` in either order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import axond
from axond.config import MAX_WORLD_SIZE, ConfigError, RuntimeEnv
from axond.errors import DistributedError, rank_list


@pytest.mark.parametrize(("env", "message"), [
    ({"WORLD_SIZE": "99999999999999999999"}, "bad WORLD_SIZE='99999999999999999999': use an integer from 1 to "
                                             f"{MAX_WORLD_SIZE} (at most AXOND_MAX_WORLD_SIZE={MAX_WORLD_SIZE}"),
    ({"WORLD_SIZE": "2000000"}, f"bad WORLD_SIZE='2000000': use an integer from 1 to {MAX_WORLD_SIZE}"),
    ({"WORLD_SIZE": "0"}, f"bad WORLD_SIZE='0': use an integer from 1 to {MAX_WORLD_SIZE}"),
    ({"WORLD_SIZE": "-1"}, f"bad WORLD_SIZE='-1': use an integer from 1 to {MAX_WORLD_SIZE}"),
    ({"AXOND_MAX_WORLD_SIZE": "8", "WORLD_SIZE": "9"}, "bad WORLD_SIZE='9': use an integer from 1 to 8"),
    ({"LOCAL_WORLD_SIZE": "0"}, "bad LOCAL_WORLD_SIZE='0': use an integer from 1 to"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "5"}, "bad LOCAL_WORLD_SIZE='5': use an integer from 1 to 4 "
                                                   "(at most WORLD_SIZE=4)"),
    ({"WORLD_SIZE": "4", "RANK": "4"}, "bad RANK='4': use an integer from 0 to 3 (below WORLD_SIZE=4)"),
    ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "bad LOCAL_RANK='2': use an integer from 0 to 1 "
                                                   "(below LOCAL_WORLD_SIZE=2)"),
    ({"AXOND_GENERATION": "-1"}, "bad AXOND_GENERATION='-1': use an integer from 0 to"),
    ({"AXOND_WAIT_NOTICE_S": "nan"}, "bad AXOND_WAIT_NOTICE_S='nan': use seconds from 0 (never) to"),
    ({"AXOND_MAX_WORLD_SIZE": "0"}, "bad AXOND_MAX_WORLD_SIZE='0': use an integer from 1 to"),
    ({"RANK": "7" * 5000}, "bad RANK='77777777777777777777'... (5000 characters): use an integer from 0 to"),
])
def test_an_out_of_range_variable_is_one_line_naming_the_range(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        RuntimeEnv.from_env(env)
    text = str(raised.value)
    assert text.startswith(message) and "\n" not in text and len(text) < 200, text


def test_the_limits_hold_where_they_are_met() -> None:
    env = RuntimeEnv.from_env({"WORLD_SIZE": str(MAX_WORLD_SIZE), "RANK": str(MAX_WORLD_SIZE - 1),
                               "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0", "AXOND_GENERATION": "0"})
    assert (env.world_size, env.rank, env.local_world_size, env.local_rank) == \
        (MAX_WORLD_SIZE, MAX_WORLD_SIZE - 1, 1, 0)
    assert RuntimeEnv.from_env({"AXOND_MAX_WORLD_SIZE": "4000000", "WORLD_SIZE": "2000000"}).world_size == 2_000_000


@pytest.mark.parametrize(("world_size", "message"), [
    (10**20, "init_process_group: world_size=100000000000000000000 is outside 1..1048576"),
    (0, "init_process_group: world_size=0 is outside 1..1048576"),
    ("1" * 50, "init_process_group: world_size='11111111111111111111.*is not an integer"),
])
def test_init_process_group_refuses_a_world_size_out_of_range(world_size: int | str, message: str) -> None:
    with pytest.raises(DistributedError, match=message):
        axond.init_process_group("tcp", 1.0, rank=0, world_size=world_size, env=RuntimeEnv.from_env({}))  # type: ignore[arg-type]


def test_a_long_list_of_ranks_is_summarised() -> None:
    assert rank_list([2, 3]) == "[2, 3]"
    assert rank_list(range(3, 2_000_000)) == "3-1999999 (1999997 ranks)"
    assert rank_list(range(0, 100, 2)) == "0, 2, 4, 6, 8, 10, 12, 14, ... 42 more (50 ranks)"


def test_a_huge_group_that_cannot_form_names_its_missing_ranks_in_one_short_line(tmp_path: Path) -> None:
    env = RuntimeEnv.from_env({"AXOND_MAX_WORLD_SIZE": "4000000", "AXOND_FILE_STORE": str(tmp_path)})
    with pytest.raises(DistributedError) as raised:
        axond.init_process_group("tcp", 0.5, rank=0, world_size=2_000_000, env=env)
    text = str(raised.value)
    assert "waiting for peer ranks 1-1999999 (1999999 ranks) to connect" in text and len(text) < 300, text[:500]


HOOKED = """
import sys
import axond
seen = []
def user_hook(kind, error, tb):
    seen.append(kind)
    print("USER HOOK", kind.__name__, len(seen), file=sys.stderr)
    previous(kind, error, tb)
previous = sys.excepthook
if sys.argv[1] == "before":
    sys.excepthook = user_hook
axond.init_process_group("tcp", 5.0, rank=0, world_size=1)
if sys.argv[1] == "after":
    previous = sys.excepthook
    sys.excepthook = user_hook
raise ValueError("boom")
"""


@pytest.mark.parametrize("order", ["before", "after"])
def test_a_users_excepthook_composes_with_the_failure_hook(tmp_path: Path, order: str) -> None:
    """The user's hook, installed between `import axond` (which installs the failure hook in a launched rank) and
    `init_process_group` (which installs it again), or after it: one traceback, the user's hook run once, and the
    error file written."""
    error_file = tmp_path / "error.json"
    env = {"PATH": "/usr/bin:/bin", "AXOND_ERROR_FILE": str(error_file), "AXOND_FILE_STORE": str(tmp_path / "store")}
    done = subprocess.run([sys.executable, "-c", HOOKED, order], env=env, capture_output=True, text=True, timeout=60)
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and lines.count("USER HOOK ValueError 1") == 1 and lines[-1] == "ValueError: boom" \
        and len(lines) < 10, done.stderr[-3000:]
    assert '"message": "boom"' in error_file.read_text()
