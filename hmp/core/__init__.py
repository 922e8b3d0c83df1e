"""What runs in every call: the wrapper (wrap) -> what a call casts (policy)
-> the weight-cast cache (cache) -> the casts (cast_copies), with the state
kept between calls beside them (state, switches); rescue when an op raises.
What each site's wrapper does is decided at convert time in hmp/binding/."""
