"""The fault grammar: specs that parse, and bad ones refused naming the fix."""

from __future__ import annotations

import pytest

from resilient_fsdp.config import ConfigError, FaultSpec, load_config, parse_fault, parse_faults


def test_fault_specs_parse_and_bad_ones_name_the_fix():
    assert parse_fault("sigkill@20:rank=3") == FaultSpec("sigkill", 20, 3)
    assert parse_fault("node-loss@5") == FaultSpec("node-loss", 5, 0)
    assert parse_fault("sigkill@20:rank=0") == FaultSpec("sigkill", 20, 0)
    assert parse_fault("node-loss@12:node=0") == FaultSpec("node-loss", 12, node=0)
    partition = parse_fault("partition@28:node=1:for=20")
    assert partition == FaultSpec("partition", 28, node=1, for_s=20.0)
    assert str(partition) == "partition@28:node=1:for=20" and partition.key == "partition@28-node1"
    assert str(parse_fault("hang-in-collective@36:rank=2")) == "hang-in-collective@36:rank=2"
    with pytest.raises(
        ConfigError, match="unknown fault kind 'segfault'; choose one of exception, exception-repeat, hang"
    ):
        parse_fault("segfault@3")
    with pytest.raises(
        ConfigError,
        match=r"expected KIND@STEP\[:rank=R \| :node=N\]\[:for=SECONDS\]\[:factor=F\], e.g. "
        "sigkill@20:rank=1",
    ):
        parse_fault("sigkill:3")
    with pytest.raises(ConfigError, match="STEP must be 1 or more"):
        parse_fault("hang@0")
    with pytest.raises(ConfigError, match="give rank=R or node=N, not both"):
        parse_fault("node-loss@3:rank=1:node=0")
    with pytest.raises(ConfigError, match="for=SECONDS applies to partition, node-freeze, writer-slow, slow-exit only"):
        parse_fault("node-loss@3:node=0:for=5")
    with pytest.raises(ConfigError, match="node-freeze needs :for=SECONDS, when the frozen node is deleted"):
        parse_fault("node-freeze@3:node=1")
    with pytest.raises(ConfigError, match="for= must be a number of seconds above 0"):
        parse_fault("partition@3:for=-1")
    with pytest.raises(ConfigError, match="unknown option 'nodes=1'"):
        parse_fault("partition@3:nodes=1")
    with pytest.raises(ConfigError, match="rank 4 does not exist in a job of 4 ranks"):
        parse_faults(["exception@3:rank=4"], world_size=4)
    with pytest.raises(ConfigError, match="node 2 does not exist in a job of 2 node"):
        parse_faults(["node-loss@3:node=2"], world_size=4, nodes=2)
    with pytest.raises(ConfigError, match="resilience.inject"):
        load_config(None, ["resilience.inject=[hang@x]"])


def test_a_memory_fault_without_the_memory_tier_or_its_replicas_is_refused_naming_the_key():
    with pytest.raises(
        ConfigError, match="memory-corrupt fault acts on memory checkpoints, and checkpoint.memory.interval_steps is 0"
    ):
        load_config(None, ["resilience.inject=[memory-corrupt@4]"])
    with pytest.raises(ConfigError, match="checkpoint.memory.replicas is 0; set it to 1"):
        load_config(None, ["resilience.inject=[replica-corrupt@4:rank=1]", "checkpoint.memory.interval_steps=2"])
    config = load_config(
        None,
        [
            "resilience.inject=[replica-corrupt@4:rank=1]",
            "checkpoint.memory.interval_steps=2",
            "checkpoint.memory.replicas=1",
        ],
    )
    assert parse_faults(config.resilience.inject, world_size=2) == [FaultSpec("replica-corrupt", 4, 1)]
