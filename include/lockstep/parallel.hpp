// lockstep/parallel.hpp: model-parallel layers (Krizhevsky's hybrid parallelism): column- and
// row-split fully connected layers over a data-parallel group, with the schemes of parallel/scheme.hpp.
#pragma once

#include "parallel/batch.hpp"
#include "parallel/column_linear.hpp"
#include "parallel/exchange.hpp"
#include "parallel/gemm.hpp"
#include "parallel/row_linear.hpp"
#include "parallel/scheme.hpp"
