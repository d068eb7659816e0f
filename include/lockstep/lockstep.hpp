// lockstep/lockstep.hpp: the umbrella header. Transports that need an optional dependency
// (transport/mpi.hpp, transport/nccl.hpp) are included on their own.
#pragma once
#include "codec.hpp"
#include "collective.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "parallel.hpp"
#include "topology.hpp"
#include "transport/concept.hpp"
#include "transport/inproc.hpp"
#include "transport/run_inproc.hpp"
