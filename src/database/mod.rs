//! CouchDB databases: any documents, each with its revision tree, as a whole CouchDB keeps them.

pub mod rev_tree;
