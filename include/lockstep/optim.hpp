// lockstep/optim.hpp: optimizers, schedules, parameter sets and the steps that fuse them with the
// collectives.
#pragma once
#include "core/thread_pool.hpp"
#include "optim/bucket.hpp"
#include "optim/concept.hpp"
#include "optim/lars.hpp"
#include "optim/param_set.hpp"
#include "optim/plan.hpp"
#include "optim/schedule.hpp"
#include "optim/split_update.hpp"
#include "optim/sgd.hpp"
#include "optim/state.hpp"
#include "optim/step.hpp"
#include "optim/update.hpp"
