// lockstep/codec.hpp: every codec.
#pragma once
#include "codec/bf16.hpp"
#include "codec/concept.hpp"
#include "codec/dyntree8.hpp"
#include "codec/elementwise.hpp"
#include "codec/error_feedback.hpp"
#include "codec/fp32.hpp"
#include "codec/int8.hpp"
