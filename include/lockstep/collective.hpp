// lockstep/collective.hpp: groups and collectives.
#pragma once
#include "collective/calibrate.hpp"
#include "collective/collectives.hpp"
#include "collective/executor.hpp"
#include "collective/group.hpp"
#include "collective/request.hpp"
