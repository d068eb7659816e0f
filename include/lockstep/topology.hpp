// lockstep/topology.hpp: every topology.
#pragma once
#include "topology/automatic.hpp"
#include "topology/concept.hpp"
#include "topology/direct.hpp"
#include "topology/halving_doubling.hpp"
#include "topology/recursive_doubling.hpp"
#include "topology/ring.hpp"
#include "topology/schedule.hpp"
#include "topology/symmetry.hpp"
#include "topology/torus2d.hpp"
