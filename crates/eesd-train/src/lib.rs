//! eesd-train
