// The shape of a device mesh before any process group exists: how many replicas of how many
// shards. Plans, policies and DeviceMesh all resolve a declared shape through the one function
// here, so a shape is accepted or refused with the same message wherever it enters.
#pragma once

namespace fsdpp {

struct MeshShape {
  int replicate = 1;  // replicas of the parameters (HSDP when > 1)
  int shard = -1;     // ranks each replica's parameters are sharded over; -1: world / replicate
};

// `declared` for a world of `world` ranks, shard = -1 taking world / replicate. A shape that
// does not fit is a UserError printing every factor ("mesh replicate 2 × shard 3 ≠ world 4").
MeshShape resolve_mesh(MeshShape declared, int world);

}  // namespace fsdpp
