"""build_mesh gives a process the same process groups back for a mesh it built before (torch's init_device_mesh
makes new ones on every call and never frees them), and nothing built under a destroyed world."""

import torch.distributed as dist

from nd_parallel.config import ParallelismConfig
from nd_parallel.distributed.mesh import build_mesh


def _groups(mesh):
    return [mesh.world.get_group(n).group_name for n in mesh.world.mesh_dim_names] + \
        [m.get_group().group_name for m in mesh.flat.values()]


def test_same_layout_reuses_groups_and_keeps_its_own_config(one_rank_group):
    a = build_mesh(ParallelismConfig(), "cpu")
    made = dist.distributed_c10d._world.group_count
    b = build_mesh(ParallelismConfig(loss_chunk_size=64), "cpu")
    assert dist.distributed_c10d._world.group_count == made, "a second build of the same layout made new groups"
    assert _groups(a) == _groups(b) and b.world is a.world
    assert b.config.loss_chunk_size == 64 and a.config.loss_chunk_size != 64


def test_nothing_is_reused_after_the_world_is_made_again(tmp_path):
    names = []
    for attempt in range(2):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store{attempt}", rank=0, world_size=1)
        try:
            mesh = build_mesh(ParallelismConfig(), "cpu")
            names.append(mesh.world)
            assert all(isinstance(mesh.world.get_group(n), dist.ProcessGroup) for n in mesh.world.mesh_dim_names)
        finally:
            dist.destroy_process_group()
    assert names[0] is not names[1]
