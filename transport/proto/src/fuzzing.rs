//! Entry points for the fuzz targets (`transport/proto/fuzz`) and for the test that replays
//! their committed corpus, so both run exactly the same code.
