// samples/common/data_error.hpp: the one exception of the sample trainers' data loading.
//
// Every reader in samples/common (IDX files, JPEG folders) throws it for bad input; what() reads
// "<file>: <what is wrong>", so a user knows which file to look at and why.
#pragma once

#include <stdexcept>

namespace sample {

struct data_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace sample
